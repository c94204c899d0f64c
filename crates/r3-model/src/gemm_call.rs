//! A cuBLAS GEMM call as data: one batched call's shape, leading dimensions and each GEMM's
//! operand offsets, column-major as cuBLAS reads them.
//!
//! Every GEMM r3 queues on cuBLAS itself (the routed experts' planned GEMMs and their
//! slots' pointer GEMM, `layers/moe/expert_gemm/`; the 16-bit attention products,
//! `layers/attention/narrow_product.rs`) is first made as a [`GemmCall`] by device-agnostic
//! code, checked against the lengths of the operands it reads and writes
//! ([`GemmCall::check_within`]), and only then turned into cuBLAS's arguments (`cuda/gemm.rs`,
//! with the `cuda` feature). A GPU would read past an operand's end, or let two GEMMs of one
//! batch race on one output, without a word; here either is an error naming the GEMM. The
//! same call runs on host slices through a plain column-major GEMM ([`GemmCall::run_host`]),
//! so the CPU tests check each call site's row-major-to-column-major arithmetic (which
//! operand is A, through the same ordering function the GPU path takes, the transposes,
//! leading dimensions, strides and offsets) against candle's own products, where before
//! only a GPU could. A pointer-array call's table is made here too
//! ([`GemmCall::pointer_table`]): the CPU tests read it back as host addresses, and the
//! emulator's tests hold the kernel that writes the slots' table on the device to it. What
//! stays GPU-only is `cuda/gemm.rs`'s handing of a call's sizes and that table to cuBLAS,
//! shared by every call site (the GPU tests run it).

use candle_core::Result;

/// One GEMM shape as cuBLAS takes it, column-major: `C (m × n) = op(A) · op(B)`, `op(A)`
/// being `m × k` and `op(B)` `k × n`. A is stored `m × k` (`k × m` with `trans_a`) with
/// leading dimension `lda`, B `k × n` (`n × k` with `trans_b`) with `ldb`, C `m × n` with
/// `ldc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GemmShape {
    /// A is stored transposed (`CUBLAS_OP_T`).
    pub(crate) trans_a: bool,
    /// B is stored transposed (`CUBLAS_OP_T`).
    pub(crate) trans_b: bool,
    /// Rows of `op(A)` and of C.
    pub(crate) m: usize,
    /// Columns of `op(B)` and of C.
    pub(crate) n: usize,
    /// The inner size: columns of `op(A)`, rows of `op(B)`.
    pub(crate) k: usize,
    /// Leading dimension of A as stored.
    pub(crate) lda: usize,
    /// Leading dimension of B as stored.
    pub(crate) ldb: usize,
    /// Leading dimension of C.
    pub(crate) ldc: usize,
}

impl GemmShape {
    /// The stored `(rows, columns)` of A, B and C, column-major.
    fn stored(&self) -> [(usize, usize); 3] {
        let a = if self.trans_a {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        };
        let b = if self.trans_b {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        };
        [a, b, (self.m, self.n)]
    }

    /// The elements A, B and C each span from the first one a GEMM touches: the last
    /// element read or written, plus one (0 for an empty matrix).
    pub(crate) fn spans(&self) -> [usize; 3] {
        let ld = [self.lda, self.ldb, self.ldc];
        let stored = self.stored();
        std::array::from_fn(|i| match stored[i] {
            (0, _) | (_, 0) => 0,
            (rows, cols) => (cols - 1) * ld[i] + rows,
        })
    }

    /// cuBLAS's own conditions on the shape, as an error naming what breaks them: every
    /// size within a 32-bit int, every leading dimension at least its matrix's stored rows
    /// (and 1). cuBLAS would answer `CUBLAS_STATUS_INVALID_VALUE` without saying which.
    fn check(&self, what: &str) -> Result<()> {
        let sizes = [
            ("m", self.m),
            ("n", self.n),
            ("k", self.k),
            ("lda", self.lda),
            ("ldb", self.ldb),
            ("ldc", self.ldc),
        ];
        if let Some((name, v)) = sizes.iter().find(|(_, v)| i32::try_from(*v).is_err()) {
            candle_core::bail!("{what}: GEMM {name} = {v} exceeds a 32-bit size");
        }
        let ld = [("A", self.lda), ("B", self.ldb), ("C", self.ldc)];
        for ((name, ld), (rows, _)) in ld.into_iter().zip(self.stored()) {
            if ld < rows.max(1) {
                candle_core::bail!(
                    "{what}: GEMM {name} stored with {rows} rows but a leading dimension of {ld}"
                );
            }
        }
        Ok(())
    }
}

/// Where the GEMMs of one batched call lie in their operands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GemmBatch {
    /// `count` GEMMs, the `i`-th at element offsets `i · strides` of A, B and C
    /// (`cublasGemmStridedBatchedEx`).
    // Made only by the GPU's 16-bit attention products and the tests.
    #[cfg_attr(not(any(test, feature = "cuda")), allow(dead_code))]
    Strided {
        /// GEMMs in the batch.
        count: usize,
        /// Elements between consecutive GEMMs' A, B and C.
        strides: [usize; 3],
    },
    /// One GEMM at each `[a, b, c]` element offset (`cublasGemmBatchedEx` over pointer
    /// arrays).
    Offsets(Vec<[usize; 3]>),
}

/// One batched GEMM call: GEMMs of one shape, each at its own offsets into A, B and C.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GemmCall {
    /// The shape every GEMM of the batch shares.
    pub(crate) shape: GemmShape,
    /// Where each GEMM lies.
    pub(crate) batch: GemmBatch,
    /// Add into C (`beta = 1`) instead of overwriting it (`beta = 0`).
    pub(crate) accumulate: bool,
}

impl GemmCall {
    /// GEMMs in the call.
    pub(crate) fn count(&self) -> usize {
        match &self.batch {
            GemmBatch::Strided { count, .. } => *count,
            GemmBatch::Offsets(offsets) => offsets.len(),
        }
    }

    /// The `[a, b, c]` element offsets of each GEMM, in batch order.
    pub(crate) fn offsets(&self) -> impl Iterator<Item = [usize; 3]> + '_ {
        (0..self.count()).map(move |i| match &self.batch {
            GemmBatch::Strided { strides, .. } => strides.map(|s| s * i),
            GemmBatch::Offsets(offsets) => offsets[i],
        })
    }

    /// Refuses a call that does not fit operands of `lens` elements (A, B, C from the
    /// addresses the call is given): a shape cuBLAS refuses, a GEMM reading or writing past
    /// an operand's end, or two GEMMs of the batch writing the same output elements (cuBLAS
    /// runs a batch's GEMMs side by side, so their sums would race). Every error names the
    /// call (`what`) and the GEMM. A strided batch in constant work (its last GEMM is the
    /// furthest, its outputs a stride apart); per-GEMM offsets one by one.
    pub(crate) fn check_within(&self, lens: [usize; 3], what: &str) -> Result<()> {
        let offsets = match &self.batch {
            // Each operand's offsets grow with the index: the last GEMM is the furthest.
            GemmBatch::Strided { count, strides } => {
                let last = count.saturating_sub(1);
                let furthest = strides.map(|s| s.checked_mul(last));
                let [Some(a), Some(b), Some(c)] = furthest else {
                    candle_core::bail!("{what}: {count} GEMMs {strides:?} apart overflow");
                };
                return check_stepped(&self.shape, *count, [a, b, c], strides[2], lens, what);
            }
            GemmBatch::Offsets(offsets) => offsets,
        };
        check_count(offsets.len(), what)?;
        self.shape.check(what)?;
        let spans = self.shape.spans();
        let mut outputs = Vec::with_capacity(offsets.len());
        for (i, &at) in offsets.iter().enumerate() {
            check_one(spans, at, lens, (i, offsets.len()), what)?;
            if spans[2] > 0 {
                outputs.push((at[2], i));
            }
        }
        // Most calls write their outputs in order; only others pay for a sort.
        if !outputs.is_sorted() {
            outputs.sort_unstable();
        }
        for pair in outputs.windows(2) {
            let [(first, i), (second, j)] = [pair[0], pair[1]];
            if second < first + spans[2] {
                candle_core::bail!(
                    "{what}: GEMMs {i} and {j} of one batch write overlapping outputs (C at \
                     {first} and {second}, {} elements each)",
                    spans[2]
                );
            }
        }
        Ok(())
    }

    /// The pointer arrays `cublasGemmBatchedEx` is handed for this call, as one table: every
    /// GEMM's A address in batch order, then every B, then every C ([`table_array`]), each
    /// its operand's base address (`bases`) plus its element offset times the operand's
    /// element size (`elem_bytes`). The kernel that writes the slots' table on the device
    /// (`r3_expert_slot_pointers`) must write this table for `SlotsLayout::call`'s call
    /// (`layers/moe/expert_gemm/slots.rs`), which the emulator's tests check.
    pub(crate) fn pointer_table(&self, bases: [u64; 3], elem_bytes: [usize; 3]) -> Vec<u64> {
        let count = self.count();
        let mut table = vec![0u64; 3 * count];
        for (i, offsets) in self.offsets().enumerate() {
            for which in 0..3 {
                table[table_array(which, count) + i] =
                    bases[which] + (offsets[which] * elem_bytes[which]) as u64;
            }
        }
        table
    }

    /// The call run on host slices by a plain column-major GEMM, each output an f32 sum
    /// over the inner index in order from zero (then added to C's value where the call
    /// accumulates): the CPU twin of what cuBLAS computes, to rounding. Checked first as a
    /// GPU launch is ([`GemmCall::check_within`]).
    pub(crate) fn run_host(&self, a: &[f32], b: &[f32], c: &mut [f32], what: &str) -> Result<()> {
        self.check_within([a.len(), b.len(), c.len()], what)?;
        let s = self.shape;
        for [oa, ob, oc] in self.offsets() {
            for j in 0..s.n {
                for i in 0..s.m {
                    let mut sum = 0f32;
                    for l in 0..s.k {
                        let av = if s.trans_a {
                            a[oa + l + i * s.lda]
                        } else {
                            a[oa + i + l * s.lda]
                        };
                        let bv = if s.trans_b {
                            b[ob + j + l * s.ldb]
                        } else {
                            b[ob + l + j * s.ldb]
                        };
                        sum += av * bv;
                    }
                    let out = &mut c[oc + i + j * s.ldc];
                    *out = if self.accumulate { *out + sum } else { sum };
                }
            }
        }
        Ok(())
    }
}

/// Where array `which` (0: A, 1: B, 2: C) of a `count`-GEMM pointer table starts, in
/// pointers: the table [`GemmCall::pointer_table`] makes and cuBLAS is handed, its three
/// arrays one after another.
pub(crate) fn table_array(which: usize, count: usize) -> usize {
    which * count
}

/// Refuses more GEMMs in one batch than cuBLAS's 32-bit count.
fn check_count(count: usize, what: &str) -> Result<()> {
    if i32::try_from(count).is_err() {
        candle_core::bail!("{what}: {count} GEMMs in one batch exceed a 32-bit count");
    }
    Ok(())
}

/// Refuses GEMM `i` of `count`, at element offsets `at`, where it touches an operand of
/// `lens` past its end (`spans`: the elements each operand's matrix spans).
fn check_one(
    spans: [usize; 3],
    at: [usize; 3],
    lens: [usize; 3],
    (i, count): (usize, usize),
    what: &str,
) -> Result<()> {
    for (which, name) in ["A", "B", "C"].into_iter().enumerate() {
        let (at, span, len) = (at[which], spans[which], lens[which]);
        if span > 0 && at.checked_add(span).is_none_or(|end| end > len) {
            candle_core::bail!(
                "{what}: GEMM {i} of {count} touches {name} elements {at}..{} of an operand \
                 of {len}",
                at.saturating_add(span)
            );
        }
    }
    Ok(())
}

/// `count` GEMMs of `shape` whose outputs lie `c_step` apart and whose offsets reach no
/// further than the GEMM at `furthest` (a strided batch, a device-written table): the shape,
/// the count, outputs that overlap, and the furthest GEMM against `lens`. Constant work.
fn check_stepped(
    shape: &GemmShape,
    count: usize,
    furthest: [usize; 3],
    c_step: usize,
    lens: [usize; 3],
    what: &str,
) -> Result<()> {
    check_count(count, what)?;
    shape.check(what)?;
    if count == 0 {
        return Ok(());
    }
    let spans = shape.spans();
    if count > 1 && c_step < spans[2] {
        candle_core::bail!(
            "{what}: GEMMs {c_step} elements apart write overlapping outputs of {}",
            spans[2]
        );
    }
    check_one(spans, furthest, lens, (count - 1, count), what)
}

/// A pointer-array call whose table a kernel writes on the device from values the host
/// never reads (the slots' experts): `count` GEMMs of `shape`, the `i`-th C at `i · c_step`,
/// none reaching further into A, B or C than the GEMM at `furthest` (each offset's largest
/// over every table the kernel can write).
#[cfg(any(test, feature = "cuda"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceTableCall {
    /// The shape every GEMM of the table shares.
    pub(crate) shape: GemmShape,
    /// GEMMs in the table.
    pub(crate) count: usize,
    /// The largest A, B and C offsets any GEMM of any such table has.
    pub(crate) furthest: [usize; 3],
    /// Elements between consecutive GEMMs' outputs.
    pub(crate) c_step: usize,
}

#[cfg(any(test, feature = "cuda"))]
impl DeviceTableCall {
    /// Refuses a table that does not fit operands of `lens` elements, as
    /// [`GemmCall::check_within`] refuses a strided batch: its furthest GEMM past an
    /// operand's end, its last output past where `furthest` says, outputs `c_step` apart
    /// that overlap (closer than C's span). Constant work: a decode step checks one a layer.
    pub(crate) fn check_within(&self, lens: [usize; 3], what: &str) -> Result<()> {
        let last_c = self.count.saturating_sub(1).checked_mul(self.c_step);
        if last_c.is_none_or(|c| c > self.furthest[2]) {
            candle_core::bail!(
                "{what}: the table's last output ({} × {}) lies past its furthest ({})",
                self.count.saturating_sub(1),
                self.c_step,
                self.furthest[2]
            );
        }
        check_stepped(
            &self.shape,
            self.count,
            self.furthest,
            self.c_step,
            lens,
            what,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(trans_a: bool, trans_b: bool, [m, n, k]: [usize; 3], ld: [usize; 3]) -> GemmShape {
        GemmShape {
            trans_a,
            trans_b,
            m,
            n,
            k,
            lda: ld[0],
            ldb: ld[1],
            ldc: ld[2],
        }
    }

    /// Row-major `p × q` matrix `x` written column-major (its transpose's row-major order),
    /// with leading dimension `ld ≥ p`, padding filled with NaN so a read of it shows.
    fn col_major(x: &[Vec<f32>], ld: usize) -> Vec<f32> {
        let (p, q) = (x.len(), x[0].len());
        let mut out = vec![f32::NAN; (q - 1) * ld + p];
        for (r, row) in x.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                out[r + c * ld] = v;
            }
        }
        out
    }

    fn transpose(x: &[Vec<f32>]) -> Vec<Vec<f32>> {
        (0..x[0].len())
            .map(|c| x.iter().map(|row| row[c]).collect())
            .collect()
    }

    /// Every transpose combination, with padded leading dimensions, gives the hand-made
    /// product `[[1, 2, 3], [4, 5, 6]] · [[1, 0], [0, 1], [2, -1]] = [[7, -1], [16, -1]]`,
    /// and C's padding is left as it was.
    #[test]
    fn each_transpose_combination_multiplies_by_hand() {
        let a = vec![vec![1.0, 2.0, 3.0], vec![4.0, 5.0, 6.0]];
        let b = vec![vec![1.0, 0.0], vec![0.0, 1.0], vec![2.0, -1.0]];
        let want = [[7.0, -1.0], [16.0, -1.0]];
        for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
            let stored_a = if trans_a { transpose(&a) } else { a.clone() };
            let stored_b = if trans_b { transpose(&b) } else { b.clone() };
            let (lda, ldb, ldc) = (stored_a.len() + 1, stored_b.len() + 2, 3);
            let call = GemmCall {
                shape: shape(trans_a, trans_b, [2, 2, 3], [lda, ldb, ldc]),
                batch: GemmBatch::Offsets(vec![[0, 0, 0]]),
                accumulate: false,
            };
            let mut c = vec![-9.0; ldc + 2];
            call.run_host(
                &col_major(&stored_a, lda),
                &col_major(&stored_b, ldb),
                &mut c,
                "test",
            )
            .expect("fits");
            let got = [[c[0], c[ldc]], [c[1], c[1 + ldc]]];
            assert_eq!(got, want, "trans_a {trans_a} trans_b {trans_b}");
            assert_eq!(c[2], -9.0, "C's padding row is not written");
        }
    }

    /// Spans by hand: A `3 × 4` stored with lda 5 spans 3 · 5 + 3 = 18; transposed (stored
    /// `4 × 3`), 2 · 5 + 4 = 14; an empty matrix spans nothing.
    #[test]
    fn spans_by_hand() {
        let s = shape(false, true, [3, 2, 4], [5, 2, 3]);
        assert_eq!(s.spans(), [18, (4 - 1) * 2 + 2, 3 + 3]);
        let t = shape(true, false, [3, 2, 4], [5, 4, 3]);
        assert_eq!(t.spans(), [14, 4 + 4, 6]);
        assert_eq!(shape(false, false, [0, 2, 4], [1, 4, 1]).spans(), [0, 8, 0]);
    }

    /// Strided batches accumulate where asked and land at their strides.
    /// The pointer table holds the A addresses, then the B's, then the C's, each its base
    /// plus its offset in its own operand's element size (by hand: bf16 A and B, f32 C).
    /// Read back as host addresses it is the call: each GEMM run alone on the slices its
    /// three pointers start gives `run_host`'s output bit for bit.
    #[test]
    fn the_pointer_table_points_at_each_gemms_operands() {
        let strided = GemmCall {
            shape: shape(false, false, [1, 1, 2], [1, 2, 1]),
            batch: GemmBatch::Strided {
                count: 2,
                strides: [2, 2, 3],
            },
            accumulate: false,
        };
        assert_eq!(
            strided.pointer_table([1000, 2000, 3000], [2, 2, 4]),
            vec![1000, 1004, 2000, 2004, 3000, 3012]
        );
        // A stored transposed (4 × 2, lda 4: 8 elements a GEMM), B 4 × 3 (12), C 2 × 3 (6).
        let call = GemmCall {
            shape: shape(true, false, [2, 3, 4], [4, 4, 2]),
            batch: GemmBatch::Offsets(vec![[8, 0, 0], [0, 12, 6], [8, 12, 12]]),
            accumulate: false,
        };
        let a: Vec<f32> = (0..16).map(|v| v as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..24).map(|v| (v % 7) as f32 - 2.5).collect();
        let mut want = vec![0f32; 18];
        call.run_host(&a, &b, &mut want, "test").expect("fits");
        let mut got = vec![f32::NAN; 18];
        let bases = [
            a.as_ptr() as u64,
            b.as_ptr() as u64,
            got.as_mut_ptr() as u64,
        ];
        let table = call.pointer_table(bases, [4; 3]);
        let alone = GemmCall {
            shape: call.shape,
            batch: GemmBatch::Offsets(vec![[0, 0, 0]]),
            accumulate: false,
        };
        let [sa, sb, sc] = call.shape.spans();
        for i in 0..3 {
            let [pa, pb, pc] = [0, 1, 2].map(|which| table[table_array(which, 3) + i]);
            // SAFETY: `check_within` held each GEMM's span inside its vector (run_host above),
            // so each pointer has its span of elements after it; `got` is not otherwise used
            // until the loop ends, and one GEMM's C span is disjoint from the others'.
            let (ra, rb, rc) = unsafe {
                (
                    std::slice::from_raw_parts(pa as *const f32, sa),
                    std::slice::from_raw_parts(pb as *const f32, sb),
                    std::slice::from_raw_parts_mut(pc as *mut f32, sc),
                )
            };
            alone.run_host(ra, rb, rc, "one GEMM").expect("fits");
        }
        assert_eq!(got, want);
    }

    #[test]
    fn a_strided_batch_lands_at_its_strides_and_accumulates() {
        // Two 1 × 1 × 2 GEMMs: c_i (+)= a_i · b_i.
        let call = GemmCall {
            shape: shape(false, false, [1, 1, 2], [1, 2, 1]),
            batch: GemmBatch::Strided {
                count: 2,
                strides: [2, 2, 3],
            },
            accumulate: true,
        };
        let (a, b) = ([1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]);
        let mut c = [10.0, 0.5, 0.5, 20.0];
        call.run_host(&a, &b, &mut c, "test").expect("fits");
        assert_eq!(c, [10.0 + 17.0, 0.5, 0.5, 20.0 + 53.0]);
        assert_eq!(
            call.offsets().collect::<Vec<_>>(),
            vec![[0, 0, 0], [2, 2, 3]]
        );
    }

    /// A call one element past an operand's end, a leading dimension under the stored rows
    /// and two GEMMs writing overlapping outputs are refused by name; the tight lengths pass.
    #[test]
    fn calls_that_do_not_fit_are_refused_by_name() {
        let s = shape(true, false, [4, 3, 2], [2, 2, 4]);
        let [sa, sb, sc] = s.spans();
        let call = |offsets: Vec<[usize; 3]>| GemmCall {
            shape: s,
            batch: GemmBatch::Offsets(offsets),
            accumulate: false,
        };
        let fits = call(vec![[0, 0, 0], [sa, sb, sc]]);
        fits.check_within([2 * sa, 2 * sb, 2 * sc], "tight")
            .expect("tight lengths fit");
        for (lens, name) in [
            ([2 * sa - 1, 2 * sb, 2 * sc], "A elements"),
            ([2 * sa, 2 * sb - 1, 2 * sc], "B elements"),
            ([2 * sa, 2 * sb, 2 * sc - 1], "C elements"),
        ] {
            let err = fits.check_within(lens, "short").expect_err("one short");
            assert!(err.to_string().contains(name), "{err}");
            assert!(err.to_string().contains("GEMM 1 of 2"), "{err}");
        }
        let overlap = call(vec![[0, 0, 0], [0, 0, sc - 1]]);
        let err = overlap
            .check_within([sa, sb, 2 * sc], "overlap")
            .expect_err("overlapping outputs");
        assert!(err.to_string().contains("GEMMs 0 and 1"), "{err}");
        let strided = |c_stride| GemmCall {
            shape: s,
            batch: GemmBatch::Strided {
                count: 2,
                strides: [sa, sb, c_stride],
            },
            accumulate: false,
        };
        strided(sc)
            .check_within([2 * sa, 2 * sb, 2 * sc], "strided")
            .expect("a stride of C's span fits");
        let err = strided(sc - 1)
            .check_within([2 * sa, 2 * sb, 2 * sc], "strided")
            .expect_err("outputs a stride short of their span");
        assert!(err.to_string().contains("overlapping"), "{err}");
        let err = strided(sc)
            .check_within([2 * sa, 2 * sb, 2 * sc - 1], "strided")
            .expect_err("the last output one short");
        assert!(err.to_string().contains("GEMM 1 of 2"), "{err}");
        let bad_ld = GemmCall {
            shape: shape(true, false, [4, 3, 2], [1, 2, 4]),
            ..call(vec![[0, 0, 0]])
        };
        let err = bad_ld
            .check_within([100; 3], "ld")
            .expect_err("lda 1 < 2 rows");
        assert!(err.to_string().contains("A stored with 2 rows"), "{err}");
        let mut c = vec![0.0; sc];
        let err = fits
            .run_host(&vec![0.0; 2 * sa], &vec![0.0; 2 * sb], &mut c, "host")
            .expect_err("the host twin checks first");
        assert!(err.to_string().contains("C elements"), "{err}");
    }
}
