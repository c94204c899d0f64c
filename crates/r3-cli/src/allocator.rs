//! Process-wide malloc tuning for tensor workloads, applied once at start-up.
//!
//! Every candle op allocates a fresh output buffer, and every gradient is accumulated into a
//! fresh zero tensor. With glibc's defaults, buffers over a few MiB are served by `mmap` and
//! unmapped on free, so each training step faults in (and the kernel zeroes) gigabytes of new
//! pages: over a quarter of `r3 bench train`'s CPU time went to page faults. Serving every
//! buffer from the heap and never trimming it lets freed buffers be reused instead.

/// Makes glibc serve all allocations from its heaps and keep freed memory for reuse.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn keep_freed_buffers() {
    // mmap is glibc's path for large blocks (up to 32 MiB it can be raised, beyond not at all:
    // the fused expert gradients are 64 MiB), so turn it off rather than raise it.
    const TRIM_THRESHOLD: libc::c_int = libc::c_int::MAX;
    // SAFETY: mallopt only adjusts allocator parameters; it is called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
    }
}

/// Other platforms keep their allocator's defaults.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn keep_freed_buffers() {}
