//! Strided matrix products on host slices (f32 / f64) through the `gemm` crate: the one
//! place the training ops call BLAS-like kernels directly. Products can also land in buffers
//! that were never zero-filled (`unfilled`, `matmul_unfilled`): a product overwrites every
//! element of its destination, and on large gradients the zero fill costs as much memory
//! traffic as the write itself. A product through a weight stored `[n, k]` is computed as
//! its transpose where that spares repacking the weight (`product_transposed_pays`).

use std::mem::MaybeUninit;

use crate::math::Float;

/// A read-only matrix view: element `(i, j)` is `data[i * row_stride + j * col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a, T> {
    /// backing elements
    pub data: &'a [T],
    /// distance between consecutive rows
    pub row_stride: usize,
    /// distance between consecutive columns
    pub col_stride: usize,
}

impl<'a, T> MatRef<'a, T> {
    /// A row-major `[rows, cols]` matrix.
    pub fn row_major(data: &'a [T], cols: usize) -> Self {
        MatRef {
            data,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of a row-major `[rows, cols]` matrix, read as `[cols, rows]`.
    pub fn transposed(data: &'a [T], cols: usize) -> Self {
        MatRef {
            data,
            row_stride: 1,
            col_stride: cols,
        }
    }

    /// Whether `[rows, cols]` elements through these strides stay inside `data`.
    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0
            || cols == 0
            || (rows - 1) * self.row_stride + (cols - 1) * self.col_stride < self.data.len()
    }
}

/// `dst [m, n] (row-major) = a [m, k] · b [k, n]`, overwriting `dst`; `threads > 1` splits
/// the product over a rayon pool.
///
/// Panics if a view is too short for its shape: callers size every buffer from the same
/// dimensions, so a short one is a bug here, not bad input.
pub fn matmul<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    threads: usize,
) {
    // SAFETY: `MaybeUninit<T>` has `T`'s layout, and the product stores only initialised values.
    let dst = unsafe { &mut *(dst as *mut [T] as *mut [MaybeUninit<T>]) };
    matmul_unfilled(m, n, k, dst, a, b, threads);
}

/// [`matmul`] into a new `[m, n]` vector, never zero-filled first (the product writes every
/// element).
pub fn matmul_vec<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    threads: usize,
) -> Vec<T> {
    let mut dst = unfilled(m * n);
    matmul_unfilled(m, n, k, &mut dst, a, b, threads);
    // SAFETY: `matmul_unfilled` wrote each of the `m·n` elements.
    unsafe { assume_init_vec(dst) }
}

/// [`matmul`] into a destination that need not be initialised; returns its first `m·n`
/// elements, now written.
pub fn matmul_unfilled<'d, T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: &'d mut [MaybeUninit<T>],
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    threads: usize,
) -> &'d mut [T] {
    assert!(dst.len() >= m * n, "gemm: destination shorter than {m}x{n}");
    assert!(a.fits(m, k), "gemm: left operand shorter than {m}x{k}");
    assert!(b.fits(k, n), "gemm: right operand shorter than {k}x{n}");
    let dst = &mut dst[..m * n];
    if m == 0 || n == 0 || k == 0 {
        return fill_zero(dst);
    }
    if threads > 1 && output_too_small_to_share(m, n, k) {
        return matmul_row_blocks(m, n, k, dst, a, b, threads);
    }
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    if product_transposed_pays(m, n, k, &b) {
        let mut t = unfilled::<T>(m * n);
        // SAFETY: as below, into `t` read as the column-major `[m, n]` product (element
        // `(i, j)` at `j·m + i`: the row-major `[n, m]` transpose), every element written.
        let t = unsafe {
            raw_gemm_strided(
                (m, n, k),
                (t.as_mut_ptr().cast::<T>(), m, 1),
                false,
                a,
                b,
                parallelism,
            );
            assume_init_slice(&mut t)
        };
        return transpose_into(t, n, m, dst, threads);
    }
    // SAFETY: the asserts above bound every element the strides address inside its slice,
    // and `dst` is a distinct, mutable, row-major `[m, n]` buffer that the product only
    // writes (`read_dst` false), every element of it.
    unsafe {
        raw_gemm(
            (m, n, k),
            dst.as_mut_ptr().cast::<T>(),
            n,
            false,
            a,
            b,
            parallelism,
        );
        assume_init_slice(dst)
    }
}

/// Whether `gemm` would leave threads idle on this product: a destination of a few
/// hundred rows and columns over a long sum (a weight's gradient `gᵀ x` summed over a batch's
/// rows) is one of its blocks, which it runs on one thread (measured: `[96, 96]` over 4,096
/// rows 320 µs on one thread, 283 µs on two; split into row blocks, 181 µs on two).
fn output_too_small_to_share(m: usize, n: usize, k: usize) -> bool {
    m >= 32 && m.saturating_mul(n) <= 512 * 512 && k >= 4 * m.max(n)
}

/// [`matmul_unfilled`] split into blocks of the destination's rows, one thread each. Every
/// element is the same sum in the same order as the whole product's: `gemm` cuts the sum
/// into blocks by `k` and the caches alone, never by `m` or `n`.
fn matmul_row_blocks<'d, T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: &'d mut [MaybeUninit<T>],
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    threads: usize,
) -> &'d mut [T] {
    use rayon::prelude::*;
    // Whole 16-row register blocks, at least one per thread.
    let rows = m.div_ceil(threads).div_ceil(16) * 16;
    dst[..m * n]
        .par_chunks_mut(rows * n)
        .enumerate()
        .for_each(|(i, part)| {
            let from = i * rows;
            let a = MatRef {
                data: &a.data[from * a.row_stride..],
                ..a
            };
            matmul_unfilled(part.len() / n, n, k, part, a, b, 1);
        });
    // SAFETY: the row blocks tile `dst[..m·n]`, and each block's product wrote it whole.
    unsafe { assume_init_slice(&mut dst[..m * n]) }
}

/// Whether `a [m, k] · b [k, n]` into a row-major destination costs less computed as its
/// transpose (a column-major destination, then one transpose pass). For a row-major
/// destination gemm swaps the operands, and then repacks the whole of a `b` that is stored
/// `[n, k]` row-major (the weight of `x · Wᵀ`: contiguous along `k`, not down the columns it
/// wants) at every call; for a column-major one it repacks `a` instead and reads such a `b`
/// as it lies. Worth it where `a` and the product are smaller than `b`: few rows through a
/// large weight (a routed expert's 128 rows through its 1024 × 512 gate-up weight ran
/// 1.4× faster on one core; 8 rows 3×).
fn product_transposed_pays<T>(m: usize, n: usize, k: usize, b: &MatRef<'_, T>) -> bool {
    b.row_stride == 1 && b.col_stride != 1 && m.saturating_mul(k + n) < n.saturating_mul(k)
}

/// Writes the row-major `[rows, cols]` matrix `t` transposed into `dst` (`[cols, rows]`,
/// every element) and returns it initialised; blocks of rows in parallel when `threads > 1`.
fn transpose_into<'d, T: Float>(
    t: &[T],
    rows: usize,
    cols: usize,
    dst: &'d mut [MaybeUninit<T>],
    threads: usize,
) -> &'d mut [T] {
    // 16 output rows a block: each block reads 16 consecutive values of every input row,
    // eight input rows at a time through a tile, so that each output row gets runs of eight
    // consecutive values rather than single scattered ones.
    const BLOCK: usize = 16;
    const GROUP: usize = 8;
    assert!(t.len() == rows * cols && dst.len() == rows * cols);
    let block = |(b, out): (usize, &mut [MaybeUninit<T>])| {
        let c0 = b * BLOCK;
        let width = out.len() / rows.max(1);
        let mut r = 0;
        while r + GROUP <= rows {
            let mut tile = [[T::ZERO; BLOCK]; GROUP];
            for (i, line) in tile.iter_mut().enumerate() {
                let from = (r + i) * cols + c0;
                line[..width].copy_from_slice(&t[from..from + width]);
            }
            for c in 0..width {
                let run = &mut out[c * rows + r..c * rows + r + GROUP];
                for (o, line) in run.iter_mut().zip(&tile) {
                    *o = MaybeUninit::new(line[c]);
                }
            }
            r += GROUP;
        }
        for r in r..rows {
            let src = &t[r * cols + c0..r * cols + c0 + width];
            for (c, &v) in src.iter().enumerate() {
                out[c * rows + r] = MaybeUninit::new(v);
            }
        }
    };
    if rows == 0 || cols == 0 {
        // SAFETY: an empty slice has no element left unwritten.
        return unsafe { assume_init_slice(dst) };
    }
    let chunk = BLOCK * rows;
    if threads > 1 && rows * cols >= 1 << 16 {
        use rayon::prelude::*;
        dst.par_chunks_mut(chunk).enumerate().for_each(block);
    } else {
        dst.chunks_mut(chunk).enumerate().for_each(block);
    }
    // SAFETY: the blocks tile `dst` (chunks of `BLOCK` output rows, the last shorter) and
    // each writes every element of its rows.
    unsafe { assume_init_slice(dst) }
}

/// `dst = a · b` (or `dst += a · b` when `read_dst`) through the `gemm` crate, `dst` rows
/// `ld` apart.
///
/// # Safety
/// Every element the shapes and strides address lies inside `dst`, `a` and `b`; `dst` is
/// valid for writes (and initialised where `read_dst`) and overlaps neither operand.
unsafe fn raw_gemm<T: Float>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    ld: usize,
    read_dst: bool,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    parallelism: gemm::Parallelism,
) {
    raw_gemm_strided((m, n, k), (dst, 1, ld), read_dst, a, b, parallelism);
}

/// [`raw_gemm`] into a destination of any strides: element `(i, j)` at
/// `dst + i·row_stride + j·col_stride`, given as `(dst, col_stride, row_stride)`.
///
/// # Safety
/// As [`raw_gemm`], for the elements these strides address.
unsafe fn raw_gemm_strided<T: Float>(
    (m, n, k): (usize, usize, usize),
    (dst, col_stride, row_stride): (*mut T, usize, usize),
    read_dst: bool,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    parallelism: gemm::Parallelism,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        col_stride as isize,
        row_stride as isize,
        read_dst,
        a.data.as_ptr(),
        a.col_stride as isize,
        a.row_stride as isize,
        b.data.as_ptr(),
        b.col_stride as isize,
        b.row_stride as isize,
        if read_dst { T::ONE } else { T::ZERO },
        T::ONE,
        false,
        false,
        false,
        parallelism,
    );
}

/// `dst [m, n]` with rows `ld` apart `= a [m, k] · b [k, n]`, or `+= a · b` when
/// `accumulate`: a block of a larger row-major matrix, written in place (one thread).
///
/// Panics if a view is too short for its shape or `ld < n` (a bug here, as for [`matmul`]).
#[allow(clippy::too_many_arguments)]
pub fn matmul_block<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    ld: usize,
    accumulate: bool,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
) {
    let len = dst.len();
    // SAFETY: `dst` is borrowed exclusively for the call, initialised, and distinct from the
    // operands (which are shared borrows).
    unsafe {
        matmul_block_shared(
            (m, n, k),
            (SharedBuf(dst.as_mut_ptr()), len),
            0,
            ld,
            accumulate,
            a,
            b,
        );
    }
}

/// [`matmul_block`] into a block of a buffer that other threads write at the same time
/// (their rows interleaved with this block's, so no `&mut` slice of the block can exist):
/// `dst` points at the block's first element, the buffer's `len` elements start at `base`.
///
/// Panics if the block reaches outside the buffer or a view is too short for its shape.
///
/// # Safety
/// `base` is valid for reads and writes of `len` initialised elements for the whole call, no
/// other thread reads or writes the `[m, n]` block's elements during it, and the block
/// overlaps neither operand.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_block_shared<T: Float>(
    (m, n, k): (usize, usize, usize),
    (base, len): (SharedBuf<T>, usize),
    offset: usize,
    ld: usize,
    accumulate: bool,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        ld >= n && offset + (m - 1) * ld + n <= len,
        "gemm: shared block {m}x{n} at {offset} (rows {ld} apart) does not fit {len} elements"
    );
    assert!(a.fits(m, k), "gemm: left operand shorter than {m}x{k}");
    assert!(b.fits(k, n), "gemm: right operand shorter than {k}x{n}");
    let dst = base.at(offset);
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                for c in 0..n {
                    dst.add(r * ld + c).write(T::ZERO);
                }
            }
        }
        return;
    }
    raw_gemm(
        (m, n, k),
        dst,
        ld,
        accumulate,
        a,
        b,
        gemm::Parallelism::None,
    );
}

/// The start of a buffer written by several threads at once, each only its own elements
/// (rows of a block in [`matmul_block_shared`], the rollout's column blocks of an output).
#[derive(Debug, Clone, Copy)]
pub struct SharedBuf<T>(pub *mut T);

impl<T> SharedBuf<T> {
    /// The pointer to element `offset`.
    ///
    /// # Safety
    /// `offset` lies inside the buffer.
    pub unsafe fn at(self, offset: usize) -> *mut T {
        self.0.add(offset)
    }
}

// SAFETY: the pointer is only dereferenced in unsafe code whose callers guarantee that no two
// threads touch the same elements while the buffer's owner lends it out.
unsafe impl<T: Send> Send for SharedBuf<T> {}
// SAFETY: as for `Send`.
unsafe impl<T: Send> Sync for SharedBuf<T> {}

/// Zero-fills `buf` and returns it initialised.
pub fn fill_zero<T: Float>(buf: &mut [MaybeUninit<T>]) -> &mut [T] {
    buf.fill(MaybeUninit::new(T::ZERO));
    // SAFETY: every element was just written.
    unsafe { assume_init_slice(buf) }
}

/// A buffer of `len` elements left unfilled, for kernels that write every element.
pub fn unfilled<T>(len: usize) -> Vec<MaybeUninit<T>> {
    let mut v = Vec::with_capacity(len);
    // SAFETY: `MaybeUninit` elements need no initialisation.
    unsafe { v.set_len(len) };
    v
}

/// The written view of a slice.
///
/// # Safety
/// Every element of `buf` has been written.
pub unsafe fn assume_init_slice<T>(buf: &mut [MaybeUninit<T>]) -> &mut [T] {
    &mut *(buf as *mut [MaybeUninit<T>] as *mut [T])
}

/// The buffer [`unfilled`] gave, once every element has been written.
///
/// # Safety
/// Every element of `buf` has been written.
pub unsafe fn assume_init_vec<T>(buf: Vec<MaybeUninit<T>>) -> Vec<T> {
    let mut buf = std::mem::ManuallyDrop::new(buf);
    Vec::from_raw_parts(buf.as_mut_ptr().cast::<T>(), buf.len(), buf.capacity())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A product through a weight stored `[n, k]` (the `x · Wᵀ` form) that is computed as
    /// its transpose equals the naive sum, one thread and several, with shapes that leave
    /// partial transpose blocks; and the route is taken exactly where it packs less.
    #[test]
    fn transposed_route_equals_the_naive_sum() {
        // The last is large enough for the parallel transpose.
        for (m, n, k) in [
            (3, 40, 24),
            (17, 70, 33),
            (1, 16, 16),
            (40, 37, 50),
            (64, 1100, 90),
        ] {
            let x: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
            let w: Vec<f64> = (0..n * k).map(|i| (i as f64 * 1.3).cos()).collect();
            let wt = MatRef::transposed(&w, k);
            assert_eq!(
                product_transposed_pays(m, n, k, &wt),
                m * (k + n) < n * k,
                "{m}x{n}x{k}"
            );
            for threads in [1, 2] {
                let got = matmul_vec(m, n, k, MatRef::row_major(&x, k), wt, threads);
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k).map(|c| x[i * k + c] * w[j * k + c]).sum();
                        assert!(
                            (got[i * n + j] - want).abs() < 1e-12,
                            "{m}x{n}x{k} ({i}, {j}), {threads} threads"
                        );
                    }
                }
            }
        }
        // A row-major `b` or a product larger than the weight keeps the direct route.
        let b = vec![0f32; 64];
        assert!(!product_transposed_pays(4, 8, 8, &MatRef::row_major(&b, 8)));
        assert!(!product_transposed_pays(
            64,
            8,
            8,
            &MatRef::transposed(&b, 8)
        ));
    }

    /// A small destination over a long sum, split into row blocks across threads, is bit
    /// for bit the one-thread product (the split never changes an element's sum), for a
    /// transposed left operand (a weight gradient `gᵀ x`) and a row-major one, with row
    /// counts that leave a short last block; and the split is taken exactly there.
    #[test]
    fn row_blocks_equal_the_one_thread_product_bit_for_bit() {
        for (m, n, k) in [
            (96, 96, 4096),
            (48, 96, 1000),
            (37, 20, 700),
            (200, 64, 2048),
        ] {
            assert!(output_too_small_to_share(m, n, k), "{m}x{n}x{k}");
            let g: Vec<f32> = (0..k * m).map(|i| (i as f32 * 0.37).sin()).collect();
            let x: Vec<f32> = (0..k * n).map(|i| (i as f32 * 1.3).cos()).collect();
            let gt = MatRef::transposed(&g, m);
            let a_rows: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.11).cos()).collect();
            for a in [gt, MatRef::row_major(&a_rows, k)] {
                let one = matmul_vec(m, n, k, a, MatRef::row_major(&x, n), 1);
                for threads in [2, 3] {
                    let split = matmul_vec(m, n, k, a, MatRef::row_major(&x, n), threads);
                    let differ = one
                        .iter()
                        .zip(&split)
                        .filter(|(p, q)| p.to_bits() != q.to_bits())
                        .count();
                    assert_eq!(differ, 0, "{m}x{n}x{k}, {threads} threads");
                }
            }
        }
        assert!(!output_too_small_to_share(4096, 96, 96));
        assert!(!output_too_small_to_share(16, 96, 4096));
        assert!(!output_too_small_to_share(1024, 1024, 8192));
    }

    /// A block product inside a wider matrix equals the naive sum, written or accumulated,
    /// and leaves the elements outside the block alone.
    #[test]
    fn block_product_equals_the_naive_sum() {
        let (m, n, k, ld) = (3, 4, 5, 7);
        let a: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
        // b stored transposed ([n, k] row-major) to exercise column strides.
        let bt: Vec<f64> = (0..n * k).map(|i| (i as f64 * 1.3).cos()).collect();
        let want = |i: usize, j: usize| (0..k).map(|c| a[i * k + c] * bt[j * k + c]).sum::<f64>();
        let mut dst = vec![2.0f64; (m - 1) * ld + n + 2];
        let (av, bv) = (MatRef::row_major(&a, k), MatRef::transposed(&bt, k));
        matmul_block(m, n, k, &mut dst, ld, false, av, bv);
        for i in 0..m {
            for j in 0..ld {
                let got = dst.get(i * ld + j).copied();
                match j < n {
                    true => assert!((got.unwrap_or(f64::NAN) - want(i, j)).abs() < 1e-12),
                    false => assert!(got.is_none_or(|v| v == 2.0), "({i}, {j}) touched"),
                }
            }
        }
        matmul_block(m, n, k, &mut dst, ld, true, av, bv);
        for i in 0..m {
            for j in 0..n {
                assert!((dst[i * ld + j] - 2.0 * want(i, j)).abs() < 1e-12);
            }
        }
        // An empty inner dimension writes zeros, or leaves an accumulated block alone.
        matmul_block(m, n, 0, &mut dst, ld, true, av, bv);
        assert!((dst[0] - 2.0 * want(0, 0)).abs() < 1e-12);
        matmul_block(m, n, 0, &mut dst, ld, false, av, bv);
        assert_eq!(dst[ld + 1], 0.0);
    }
}
