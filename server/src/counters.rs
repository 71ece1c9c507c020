//! Counters that one part of the server keeps and STATS, in the RPC
//! service, exports: here so that neither part depends on the other.

use std::sync::atomic::AtomicU64;

/// What the one-sided engine counts. Relaxed atomics: they are statistics.
#[derive(Debug, Default)]
pub struct EngineCounters {
    pub batches: AtomicU64,
    pub reads: AtomicU64,
    pub bytes: AtomicU64,
    pub rejected: AtomicU64,
}
