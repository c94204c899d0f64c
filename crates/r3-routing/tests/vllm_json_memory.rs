//! Memory a vLLM 0.21 JSON payload may make the decoder take: bounded by what the payload
//! holds, not by the row count it claims. A list of a hundred thousand empty rows (300 kB)
//! for a 16-layer top-8 model once reserved the ids of that many full rows (100 MB) before
//! the first row was found short. Its own binary: the allocator below counts every
//! allocation of the process.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use r3_routing::wire::{vllm_json, WireShape};

/// The system allocator, noting the largest single request since the last reset.
struct Largest;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded as received.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as received.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: forwarded as received.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Largest = Largest;

#[test]
fn empty_rows_do_not_reserve_the_ids_they_claim() {
    let rows = 100_000;
    let text = format!(
        "{{\"prompt_routed_experts\": [{}]}}",
        vec!["[]"; rows].join(",")
    );
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let shape = WireShape::new(16, 8, 64);
    LARGEST.store(0, Ordering::Relaxed);
    let err = vllm_json::decode_vllm_json(&v, &shape).expect_err("rows without layers");
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(err.to_string().contains("layers in"), "{err}");
    assert!(
        largest <= text.len(),
        "the decoder asked for {largest} bytes at once for {} bytes of JSON",
        text.len()
    );
}
