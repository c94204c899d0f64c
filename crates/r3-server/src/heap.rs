//! Handing the heap's free memory back to the operating system once the engine's large host
//! buffers are gone: the checkpoint read at start (f32 tensors, then the engine's own
//! formats built from them), an update's staged weights and the old weights it replaced,
//! the host copy of weights brought back to the device (all on the engine worker's thread),
//! and a refused update's checkpoint (on its loader thread, `admin.rs`).
//!
//! `r3` runs with glibc told to serve every buffer from its heaps and never trim them (the
//! CLI's `allocator::keep_freed_buffers`: a step's freed tensors are reused by the next
//! instead of being faulted in again), and even by default glibc returns only a free stretch
//! at the very top of a heap. So what a load freed stayed resident: `r3 serve` held 4.7× the
//! memory its weights take once a 428 MB checkpoint had loaded on the CPU engine (1.06 GB
//! resident, 224 MB after trimming), for as long as the server ran. `malloc_trim` returns
//! the free pages whatever those settings; the steps' own working set is taken again at the
//! next step and kept from then on.

/// Returns the heap's free pages to the operating system (glibc's `malloc_trim`); nothing
/// where the allocator is not glibc's.
pub fn return_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointer; it walks the allocator's own free lists under
    // the allocator's locks, and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}
