//! r3's CUDA kernels (`crates/r3-model/src/cuda/kernels.cu`) run on the host, so that a
//! machine without a GPU (CI) checks what they compute. build.rs compiles the kernels' own
//! source for the host twice (rounded as written, and with multiplies and adds contracted
//! into fused multiply-adds as nvcc contracts them), and [`launch`] runs one over an emulated
//! grid: the blocks one after another, each block's threads as fibers that switch at its
//! barriers and warp shuffles, in the order asked ([`ThreadOrder`]), so a kernel whose
//! answer depends on which thread runs first shows two answers. What this cannot see: a
//! GPU's own arithmetic where it differs from the host's (`expf` and `logf` a few ulps
//! apart, the NaN a GPU's f32 operations write), memory-model races between blocks, and the
//! launch code in r3-model that picks each kernel's grid and arguments (the GPU tests of
//! `scripts/cuda/check.sh` cover those).

use std::ffi::c_void;

mod kernels;

pub use kernels::{Kernels, FMA, PLAIN};

/// Why an emulated launch did not complete.
#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    /// Every live thread of a block waits at a barrier the others never reach.
    #[error("a block deadlocked: its live threads wait at barriers the others never reach")]
    Deadlock,
    /// The grid or block has a shape the emulator does not run.
    #[error("a launch of {grid:?} blocks of {block} threads: blocks are 1 to 1,024 threads along x, grids at least one block each way")]
    Shape {
        /// The grid asked for.
        grid: [u32; 3],
        /// The threads a block asked for.
        block: u32,
    },
    /// Memory for the fibers' stacks or the launch's buffers could not be had.
    #[error("the emulator ran out of memory for the launch's stacks or buffers")]
    Memory,
    /// A warp shuffle read a lane that was not in the exchange (exited, or past a partial
    /// warp's end): undefined on a GPU.
    #[error(
        "a warp shuffle read a lane that is not in the exchange (exited, or past the block's end)"
    )]
    AbsentLane,
    /// A vector type (`float4`, `uint4`, a 16-bit pair) was read or written off its
    /// alignment: a fault on a GPU.
    #[error("a vector access off its alignment")]
    Misaligned,
    /// A kernel wrote past the dynamic shared memory its launch asked for.
    #[error("a write past the launch's dynamic shared memory")]
    SharedOverrun,
}

/// The order a block's threads are resumed in between barriers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadOrder {
    /// Thread 0 first.
    Forward,
    /// The last thread first.
    Backward,
}

/// Both orders, to run a launch under each.
pub const ORDERS: [ThreadOrder; 2] = [ThreadOrder::Forward, ThreadOrder::Backward];

/// A launch's shape: `grid` blocks (x, y, z) of `block` threads along x, with
/// `shared_bytes` of dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    /// Blocks along x, y and z.
    pub grid: [u32; 3],
    /// Threads per block (along x).
    pub block: u32,
    /// Bytes of dynamic shared memory (`extern __shared__`).
    pub shared_bytes: usize,
}

impl LaunchShape {
    /// `blocks` blocks along x of `threads` threads, no dynamic shared memory.
    pub fn blocks(blocks: u32, threads: u32) -> Self {
        Self {
            grid: [blocks, 1, 1],
            block: threads,
            shared_bytes: 0,
        }
    }

    /// r3-model's one-block-per-row launch: `rows` blocks of `threads`.
    pub fn per_row(rows: usize, threads: u32) -> Self {
        Self::blocks(
            u32::try_from(rows).expect("a grid of at most u32::MAX rows"),
            threads,
        )
    }

    /// r3-model's grid-stride launch over `n` elements (`launch_shape::elementwise_blocks`
    /// blocks of `ELEMENTWISE_THREADS`).
    pub fn elementwise(n: usize) -> Self {
        Self::blocks(
            r3_model::launch_shape::elementwise_blocks(n),
            r3_model::launch_shape::ELEMENTWISE_THREADS,
        )
    }

    /// The same shape with `bytes` of dynamic shared memory.
    pub fn with_shared_bytes(self, bytes: usize) -> Self {
        Self {
            shared_bytes: bytes,
            ..self
        }
    }
}

extern "C" {
    fn r3emu_launch(
        grid: *const u32,
        block: *const u32,
        shared_bytes: usize,
        backward: i32,
        body: extern "C" fn(*const c_void),
        data: *const c_void,
    ) -> i32;
}

/// The emulator's own faulty kernels (`emu/faulty_kernels.cpp`), for its tests.
#[doc(hidden)]
pub mod faulty {
    extern "C" {
        /// Reads shared memory another thread wrote, with no barrier between.
        pub fn r3emu_faulty_unsynced_read(out: *mut f32);
        /// The same read after a barrier.
        pub fn r3emu_synced_read(out: *mut f32);
        /// Thread 0 waits at the block's barrier, its warp in a shuffle.
        pub fn r3emu_faulty_split_barrier(out: *mut f32);
        /// Lanes below 16 shuffle with lanes that have finished.
        pub fn r3emu_faulty_shuffle_of_exited_lanes(out: *mut f32);
        /// Thread 0 reads after a barrier what thread 1 writes then, with no barrier between.
        pub fn r3emu_faulty_read_after_barrier(out: *mut f32);
        /// Each thread writes a float at its index into the dynamic shared memory.
        pub fn r3emu_faulty_dynamic_shared_write(out: *mut f32);
    }
}

std::thread_local! {
    /// The first panic of a launch body on this thread, raised again when the launch ends.
    static BODY_PANIC: std::cell::RefCell<Option<Box<dyn std::any::Any + Send>>> =
        const { std::cell::RefCell::new(None) };
}

/// Calls the body a launch's fibers run: `data` is a `&&dyn Fn()`. A panic stops at this
/// frame (it must not unwind through the emulator's C++ frames) and is raised again by
/// [`launch`] once the grid is done, so a test fails as a test rather than aborting.
extern "C" fn run_body(data: *const c_void) {
    // SAFETY: `launch` passes a pointer to a `&dyn Fn()` that outlives the launch.
    let body = unsafe { &*(data as *const &dyn Fn()) };
    if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        BODY_PANIC.with(|first| {
            first.borrow_mut().get_or_insert(payload);
        });
    }
}

/// Runs `body` as every thread of a grid of `shape`, the blocks and a block's threads
/// resumed in `order`. A panic of `body` is raised again here once the grid is done.
/// `body` calls one kernel of [`PLAIN`] or [`FMA`] with its arguments; the kernel reads its
/// thread's indices from the emulator.
pub fn launch(shape: LaunchShape, order: ThreadOrder, body: &dyn Fn()) -> Result<(), EmuError> {
    let block = [shape.block, 1, 1];
    let backward = i32::from(order == ThreadOrder::Backward);
    let data: *const &dyn Fn() = &body;
    // SAFETY: the grid and block arrays hold three values each; `run_body` reads `data` as
    // the `&dyn Fn()` it points at, which lives until this call returns.
    let status = unsafe {
        r3emu_launch(
            shape.grid.as_ptr(),
            block.as_ptr(),
            shape.shared_bytes,
            backward,
            run_body,
            data.cast(),
        )
    };
    if let Some(payload) = BODY_PANIC.with(|first| first.borrow_mut().take()) {
        std::panic::resume_unwind(payload);
    }
    match status {
        0 => Ok(()),
        1 => Err(EmuError::Deadlock),
        3 => Err(EmuError::Memory),
        4 => Err(EmuError::AbsentLane),
        5 => Err(EmuError::Misaligned),
        6 => Err(EmuError::SharedOverrun),
        _ => Err(EmuError::Shape {
            grid: shape.grid,
            block: shape.block,
        }),
    }
}

/// The kernel variants this host can run, named: the plain one always, the contracted one
/// where the CPU has fused multiply-adds.
pub fn variants() -> Vec<(&'static str, &'static Kernels)> {
    let mut out = vec![("plain", &PLAIN)];
    // Only where the contracted build really fuses (a compiler or flags that do not would
    // make it a second plain variant, and its tests prove nothing more).
    if fma_available() && variants_contract_as_named().1 {
        out.push(("fma", &FMA));
    }
    out
}

extern "C" {
    fn r3emu_plain_probe(a: f32, b: f32, c: f32) -> f32;
    fn r3emu_fma_probe(a: f32, b: f32, c: f32) -> f32;
}

/// Whether each variant computes `a · b + c` as it claims: (plain rounds the product, fma
/// fuses it). The operands make the two differ: (1 + 2⁻¹²)² − 1 is 2⁻¹¹ + 2⁻²⁴ exactly, and
/// 2⁻¹¹ with the product rounded.
pub fn variants_contract_as_named() -> (bool, bool) {
    let a = 1.0 + 2f32.powi(-12);
    let exact = 2f32.powi(-11) + 2f32.powi(-24);
    // SAFETY: plain functions of three floats.
    let (plain, fused) = unsafe { (r3emu_plain_probe(a, a, -1.0), r3emu_fma_probe(a, a, -1.0)) };
    (plain == 2f32.powi(-11), fused == exact)
}

/// Whether the host runs the contracted variant's instructions.
fn fma_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        true
    }
}

/// Runs `run` (which makes fresh outputs, launches one kernel over them in the order it is
/// given and returns them) once in each [`ThreadOrder`] and returns the outputs, which must
/// be the same bits both times: a kernel whose threads race (a read of shared memory another
/// thread may not have written yet, a missing barrier) gives two answers. `what` names the
/// launch in the panic.
pub fn in_both_orders<T: PartialEq + std::fmt::Debug>(
    what: &str,
    run: impl Fn(ThreadOrder) -> T,
) -> T {
    let forward = run(ThreadOrder::Forward);
    let backward = run(ThreadOrder::Backward);
    assert!(
        forward == backward,
        "{what}: the threads' order changes the result (forward {forward:?}, backward {backward:?})"
    );
    forward
}
