//! `return_free_heap` gives freed heap memory back to the operating system: memory freed
//! between live allocations (so glibc's own trimming of a heap's top cannot return it) stays
//! resident until the call, and leaves once it is made. A test binary of its own, so no other
//! test allocates beside it.

#![cfg(all(target_os = "linux", target_env = "gnu"))]

use r3_server::heap::return_free_heap;

/// Resident bytes of this process (`/proc/self/statm`'s second field, in pages).
fn resident_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("read /proc/self/statm");
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|f| f.parse().ok())
        .expect("resident pages in /proc/self/statm");
    // SAFETY: sysconf reads a constant of the system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * usize::try_from(page).expect("a page size")
}

#[test]
fn freed_heap_memory_leaves_the_process_once_returned() {
    // Each below glibc's 128 KiB threshold for a mapping of its own; 120 MiB in all, half of
    // it freed.
    const BLOCK: usize = 96 << 10;
    const BLOCKS: usize = 1280;
    // As a checkpoint's tensors: many heap blocks, each written to.
    let mut blocks: Vec<Vec<u8>> = (0..BLOCKS).map(|i| vec![i as u8 | 1; BLOCK]).collect();
    let held = resident_bytes();
    // Every other block freed: each freed one lies between two live ones, wherever the
    // allocator put them, so none joins the free top of a heap.
    for block in blocks.iter_mut().step_by(2) {
        *block = Vec::new();
    }
    let freed = resident_bytes();
    return_free_heap();
    let returned = resident_bytes();
    assert!(blocks.iter().skip(1).step_by(2).all(|b| b[BLOCK - 1] != 0));
    let mib = |b: usize| b as f64 / f64::from(1 << 20);
    println!(
        "resident: {:.1} MiB holding the blocks, {:.1} MiB freed, {:.1} MiB after return_free_heap",
        mib(held),
        mib(freed),
        mib(returned)
    );
    let total = BLOCK * BLOCKS / 2;
    assert!(
        freed + total / 2 > held,
        "freeing alone already returned most of the blocks ({:.1} → {:.1} MiB): the test no \
         longer sees what the call does",
        mib(held),
        mib(freed)
    );
    assert!(
        returned + total / 2 < freed,
        "return_free_heap returned less than half of {:.0} MiB freed ({:.1} → {:.1} MiB)",
        mib(total),
        mib(freed),
        mib(returned)
    );
}
