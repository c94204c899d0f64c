//! Handing the heap's free memory back to the operating system once the engine's large host
//! buffers are gone: the checkpoint read at start (f32 tensors, then the engine's own
//! formats built from them), an update's staged weights and the old weights it replaced,
//! the host copy of weights brought back to the device.
//!
//! glibc's allocator keeps freed memory in its arenas for later allocations, returning to
//! the system only a free stretch at the very top of a heap. A checkpoint is read as many
//! tensors, each below the size glibc maps on its own, and the engine's formats are
//! allocated after them, so what the load freed stays resident: `r3 serve` held 4.7× the
//! memory its weights take once a 428 MB checkpoint had loaded on the CPU engine (1.06 GB
//! resident, 224 MB after trimming). A server runs for days; that memory was never used
//! again.

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
