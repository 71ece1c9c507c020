//! What a GET on the calling thread returns, and the buffers it reuses.

use dmkv_common::read::ReadSpec;

use super::backend::Reads;

/// Reusable buffers of local GETs. One per calling thread (or caller):
/// they grow to the largest item read and then stay, so GETs allocate
/// nothing.
#[derive(Debug, Default)]
pub struct Scratch {
    pub(super) specs: Vec<ReadSpec>,
    pub(super) reads: Reads,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Keys a thread reads locally through the async API between two yields
/// to its runtime.
pub const LOCAL_GETS_PER_YIELD: usize = 8;

thread_local! {
    static SINCE_YIELD: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Counts `keys` more local reads on this thread; true when it is time to
/// yield. A local GET never waits, so tasks doing them would keep their
/// thread from the runtime's other work: a PUT's reply waited in its
/// socket behind runs of GETs (workload B, 2×16: a PUT's p50 419 µs
/// without yielding, 405 µs with tokio's cooperative budget, 218 µs
/// yielding every 8 GETs, 128 µs every GET for a quarter less GET
/// throughput; docs/performance.md).
pub fn yield_due(keys: usize) -> bool {
    SINCE_YIELD.with(|n| {
        let since = n.get().saturating_add(keys);
        let due = since >= LOCAL_GETS_PER_YIELD;
        n.set(if due { 0 } else { since });
        due
    })
}

/// Runs `f` with this thread's scratch buffers.
pub fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with_borrow_mut(f)
}

/// What a found item carries besides its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemMeta {
    pub version: u64,
    /// Client flags and expiry (unix second; 0: never).
    pub flags: u32,
    pub expires_at: u32,
}

/// The result of a local GET; a found value is in the caller's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalGet {
    Found(ItemMeta),
    Missing,
    /// Verification kept failing (or the server must judge the item): ask
    /// the server over RPC.
    GiveUp,
}
