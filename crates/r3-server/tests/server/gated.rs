//! Any backend behind a gate the test opens: while it is closed, steps make no progress (the
//! requests in flight stay in flight however long the test takes), so a test can act on a
//! request that is certainly still running, and a request that ends while it is closed was
//! ended by the server (aborted), never by the engine.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use r3_server::InferenceBackend;

use crate::paced::{BeforeStep, Hooked};

/// The test's side of the gate.
#[derive(Clone, Default)]
pub struct Gate(Arc<AtomicBool>);

impl Gate {
    /// A closed gate.
    pub fn closed() -> Self {
        Gate::default()
    }

    /// Lets the steps run from now on.
    pub fn open(&self) {
        self.0.store(true, Ordering::Release);
    }

    fn is_open(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Opens its gate when dropped: declared after a test's server, it lets the requests a
/// failed test left in flight finish, so the server's shutdown (which answers them first)
/// ends and the test fails instead of hanging.
pub struct OpenOnDrop(pub Gate);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

impl BeforeStep for Gate {
    fn before_step(&mut self, _in_flight: usize) -> bool {
        if !self.is_open() {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.is_open()
    }
}

/// `inner`, stepping only once its gate is open.
pub type Gated<B> = Hooked<B, Gate>;

impl<B: InferenceBackend> Hooked<B, Gate> {
    /// `inner` behind `gate`.
    pub fn new(inner: B, gate: Gate) -> Self {
        Hooked::with_hook(inner, gate)
    }
}

/// Waits until `done` holds, checking every millisecond; panics with `what` after a minute
/// (a hang guard only: every wait here ends in milliseconds when the server behaves).
pub fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}
